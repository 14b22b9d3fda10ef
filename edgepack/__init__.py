__version__ = "0.1.0"


def load(path, **kwargs):
    """An artifact or an ONNX file behind one API (see edgepack.sdk)."""
    from .sdk import load as _load
    return _load(path, **kwargs)
