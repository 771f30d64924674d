"""fedshard's lab tooling, a separate distribution (``fedshard-lab``, ``pip install -e ./lab``).

- :mod:`fedshard_lab.experiments` - suites of runs, their reports and plots
  (``python -m fedshard_lab.experiments``).
- :mod:`fedshard_lab.engine` - in-process simulation engines (``python -m fedshard_lab.engine``).
- :mod:`fedshard_lab.shakespeare_build` - the Shakespeare data set built from the plays' text
  (``python -m fedshard_lab.shakespeare_build DATA_DIR``).

It imports :mod:`fedshard`; ``fedshard`` never imports it, and neither fedshard's wheel nor its
Flower app bundle carries it.
"""

__all__: list[str] = []  # a namespace for the tools; import its subpackages
