import sys

from remote.tracker.daemon import build_parser, run

sys.exit(run(build_parser().parse_args()))
