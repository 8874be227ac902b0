"""A faster ``triton.runtime.interpreter._patch_builtin`` for the CPU tests (``TRITON_INTERPRET=1``).

The interpreter points ``triton.language``'s builtins at its own implementations before every kernel launch
and again at every call of a ``@triton.jit`` helper from inside a kernel, and each time it finds them by
listing every member of ``triton.language``, ``tl.tensor``, ``tl.math`` and ``tl.core`` with
``inspect.getmembers``. The helpers of the logprob and JSD kernels are called once per row and block, so the
listing took about a third of the CPU time of the tests that run those kernels (tests/losses/test_row_steps.py
measured 34 s -> 22 s with this module).

Here the names of each module's builtins are listed once (at a call that finds the module unpatched), and
each later call patches those of them that are still builtins, as the interpreter's own function does: the
same functions are patched, the kernels run the same numpy operations. A module whose builtins are already
patched (a helper called inside a kernel) is left as it is, as the interpreter's listing would find no
builtin in it.
"""

from __future__ import annotations

import inspect


def install() -> bool:
    """Puts the listing-once ``_patch_builtin`` in place; False (nothing changed) where this Triton's
    interpreter lacks the functions it replaces."""
    from triton.language.core import is_builtin
    from triton.runtime import interpreter

    patch_attr = getattr(interpreter, "_patch_attr", None)
    original = getattr(interpreter, "_patch_builtin", None)
    if patch_attr is None or original is None or getattr(original, "lists_once", False):
        return False
    if list(inspect.signature(original).parameters) != ["pkg", "builder", "scope"]:
        return False
    names: dict[object, list[str]] = {}

    def patch_builtin(pkg, builder, scope):
        listed = names.get(pkg)
        if listed is None:
            listed = [name for name, member in inspect.getmembers(pkg) if is_builtin(member)]
            if not listed:  # already patched by an enclosing launch: nothing to patch, nothing to remember
                return
            names[pkg] = listed
        if not is_builtin(getattr(pkg, listed[0])):  # a scope patches a module's builtins all together
            return
        for name in listed:
            member = getattr(pkg, name)
            if is_builtin(member):
                patch_attr(pkg, name, member, builder, scope)

    patch_builtin.lists_once = True
    interpreter._patch_builtin = patch_builtin
    return True
