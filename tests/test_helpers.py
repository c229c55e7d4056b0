"""tests/helpers.py: what the suite's own machinery promises."""

from tests.helpers import scan_interpreter_builtins_once


def test_the_interpreter_patches_what_its_own_scan_would():
    """``scan_interpreter_builtins_once`` lists each module's builtins once; patching through the
    list sets the same attributes as Triton's scan of the module, and the scan is kept for modules
    not listed."""
    from triton.runtime import interpreter

    scan_interpreter_builtins_once()
    listed = interpreter._patch_builtin
    assert listed.listed and all(listed.listed.values())
    for pkg in listed.listed:
        patched = []
        for patch in (listed.scan, listed):
            scope = interpreter._LangPatchScope()
            patch(pkg, interpreter.interpreter_builder, scope)
            patched.append(sorted(name for _, name, _ in scope._changes))
            scope.restore()
        assert patched[0] == patched[1] and patched[0], pkg
