"""Offline throughput benchmark; same as `runtime bench throughput`.

    python benchmarks/throughput.py --num-prompts 64 --input-len 16,256 --output-len 16,256 --backends runtime,hf
"""

import argparse
import sys

from runtime.bench.throughput import add_arguments, main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
