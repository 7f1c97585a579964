"""``torch._logging`` names: ``TORCH_LOGS=kimi_inductor`` (match reports: this package's
loggers) and ``TORCH_LOGS=kimi_graphs`` (graphs before and after every pass).

torch parses ``TORCH_LOGS`` at ``import torch``, before this module can register
anything, and accepts only its own names and importable modules. Both names are
modules (``kimi_graphs`` is the empty top-level ``kimi_graphs.py`` installed with the
package), so torch enables their loggers at INFO (``+name``: DEBUG) on its own, whether
``python -m kimi_inductor`` runs or user code imports us later. The passes dump graphs
at DEBUG; ``graph_log`` passes them to the ``kimi_graphs`` logger at INFO or finer, so
that ``TORCH_LOGS=kimi_graphs`` alone shows them.
"""

from __future__ import annotations

import logging

from torch._logging import _internal

GRAPHS = "kimi_graphs"
_internal.register_log("kimi_inductor", "kimi_inductor")
_internal.register_log(GRAPHS, GRAPHS)  # also torch._logging.set_logs(kimi_graphs=logging.INFO)


class _GraphLog(logging.LoggerAdapter):
    """The ``kimi_graphs`` logger with DEBUG records raised to INFO (the level a plain
    ``TORCH_LOGS=kimi_graphs`` enables); on only where its own level is set (TORCH_LOGS,
    ``set_logs``), not through a root logger at INFO: printing graphs is costly."""

    def isEnabledFor(self, level: int) -> bool:
        own = self.logger.level
        return own != logging.NOTSET and max(level, logging.INFO) >= own

    def log(self, level: int, msg, *args, **kwargs) -> None:
        if self.isEnabledFor(level):
            kwargs.setdefault("stacklevel", 2)  # the record names the caller, not this adapter
            self.logger.log(max(level, logging.INFO), msg, *args, **kwargs)


graph_log = _GraphLog(logging.getLogger(GRAPHS), {})
