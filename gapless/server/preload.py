"""Imported once by the server's fork server, so that each worker forked from it starts with these
modules loaded instead of importing them itself."""

import torch  # noqa: F401
import transformers  # noqa: F401
from transformers import AutoTokenizer  # noqa: F401

import gapless.engine.detokenize  # noqa: F401
import gapless.engine.engine  # noqa: F401
import gapless.server.workers.scheduler_loop  # noqa: F401
import gapless.server.workers.text_worker  # noqa: F401
