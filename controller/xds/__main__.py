"""Print the example bootstrap for a config file: ``python -m controller.xds deploy/local.yaml``."""

import sys

from controller.xds.bootstrap import render_example
from poolgate.kernel.config import load_config

source = sys.argv[1] if len(sys.argv) > 1 else "deploy/local.yaml"
sys.stdout.write(render_example(load_config(source), source))
