"""Spellings of the decoder's roles: one module per producer of decoder graphs, each
defining ``SPELLING`` (``passes.roles.Spelling``). ``roles`` finds every module here."""
