"""``tokenmill bench``: ladders of cumulative switches, measured rung by rung, and sizing searches.

- :mod:`tokenmill.bench.schema`: the ladder TOML format, its validation and the per-rung configs.
- :mod:`tokenmill.bench.runner`: runs each rung in a fresh ``tokenmill train`` subprocess.
- :mod:`tokenmill.bench.report`: derived figures, ``ladder.json`` and ``ladder.md``.
- :mod:`tokenmill.bench.plot`: ``ladder.png``.
- :mod:`tokenmill.bench.sizing`: ``max-batch`` and ``max-model`` searches.
- :mod:`tokenmill.bench.cli`: the ``tokenmill bench`` sub-commands.

The shipped ladders live in ``tokenmill/bench/ladders/*.toml``; ``docs/bench.md`` describes them.
"""
