"""Every private or version-dependent name chunkloss borrows from another library, behind one small accessor
each: :mod:`.torch`, :mod:`.transformers`, :mod:`.trl`, :mod:`.accelerate`. Each accessor's docstring names
the versions it serves; ``tests/test_compat.py`` checks that every name still exists in the installed versions
and says when each version workaround can go. Nothing here imports the rest of chunkloss."""
