"""Entry point of the frozen (PyInstaller one-file) edgepack: the same CLI as `python -m edgepack`."""
from edgepack.cli import main

main()
