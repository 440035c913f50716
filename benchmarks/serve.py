"""Online serving benchmark against a running server; same as `runtime bench serve`.

    runtime serve MODEL --port 8000 &
    python benchmarks/serve.py --port 8000 --num-prompts 100 --request-rate 4 --max-concurrency 16
"""

import argparse
import sys

from runtime.bench.serve import add_arguments, main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
