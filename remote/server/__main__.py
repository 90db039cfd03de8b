import sys

from remote.server.daemon import build_parser, run

sys.exit(run(build_parser().parse_args()))
