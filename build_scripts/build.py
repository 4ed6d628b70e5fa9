"""Build an engine directory: `python build_scripts/build.py --model M --draft-model D --output engines/NAME`.
Same as `echo-trtllm build`."""

import sys

from echo_trtllm.cli.build import main

if __name__ == "__main__":
    sys.exit(main())
