"""``python -m trio_vstream``: serve (see ``trio_vstream.cli``)."""

import sys

from trio_vstream.cli import main

if __name__ == "__main__":
    sys.exit(main(whole_process=True))
