"""Engine time per step outside the model; same as `runtime bench step-overhead`."""

import argparse
import sys

from runtime.bench.step_overhead import add_arguments, main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
