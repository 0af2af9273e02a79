"""A rank process: `python -m gapless.engine.tp FD`, FD its end of the pipe to the process that started
it (see `gapless.engine.tp.worker`)."""

import sys

from gapless.engine.tp.worker import rank_entry

if __name__ == "__main__":
    rank_entry(int(sys.argv[1]))
