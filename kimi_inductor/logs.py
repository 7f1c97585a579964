"""``torch._logging`` registration: ``TORCH_LOGS=kimi_inductor`` (match reports) and
``TORCH_LOGS=kimi_graphs`` (graphs before and after every pass)."""

from __future__ import annotations

import os

import torch._logging
from torch._logging import _internal

_internal.register_log("kimi_inductor", "kimi_inductor")
_internal.register_artifact("kimi_graphs", "kimi_inductor's graphs before and after each pass", off_by_default=True)
if any(name in os.environ.get("TORCH_LOGS", "") for name in ("kimi_inductor", "kimi_graphs")):
    _internal._init_logs()  # TORCH_LOGS was parsed before these names existed

graph_log = torch._logging.getArtifactLogger("kimi_inductor.passes", "kimi_graphs")
