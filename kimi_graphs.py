"""``TORCH_LOGS=kimi_graphs``: kimi_inductor's graphs before and after every pass.

This module is empty on purpose. torch parses ``TORCH_LOGS`` when it is imported, before
any code of ours runs, and refuses (at ``import torch``, in every process) a name that is
neither one of its own logs nor an importable module. Installed beside ``kimi_inductor``,
this module makes ``kimi_graphs`` such a name: torch enables the logger ``kimi_graphs``,
and ``kimi_inductor.logs`` writes the graphs to it (see that module).
"""
