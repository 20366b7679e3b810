"""pytest plugin (``-p stages12``): deselect the tests of ZeRO stage 3, whose parameter
``zero_stage`` (or any parameter with ``stage`` in its name) is 3: flatzero is ZeRO-1/2 and
the router hands stage 3 to DeepSpeed, so those runs would compare DeepSpeed with itself."""


def _stage3(item) -> bool:
    params = getattr(getattr(item, "callspec", None), "params", {})
    return any("stage" in name and value == 3 for name, value in params.items())


def pytest_collection_modifyitems(config, items):
    deselected = [item for item in items if _stage3(item)]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not _stage3(item)]
