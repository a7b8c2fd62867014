"""Compiling stage programs: a model cut into stages (explicit, or split at its
``stage_boundary`` markers), each stage traced into its forward, backward and ``I``/``W``
halves and jitted for its stage mesh."""
