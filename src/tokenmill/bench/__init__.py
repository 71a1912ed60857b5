"""``tokenmill bench``: ladders of cumulative switches, measured rung by rung, and sizing searches.

- :mod:`tokenmill.bench.schema`: the ladder TOML format and its validation.
- :mod:`tokenmill.bench.configs`: the per-rung configs and step plans.
- :mod:`tokenmill.bench.load`: finding, parsing and validating a ladder (above schema and configs).
- :mod:`tokenmill.bench.runner`: runs each rung in a fresh ``tokenmill train`` subprocess.
- :mod:`tokenmill.bench.ladder`: a measured ladder, rung by rung.
- :mod:`tokenmill.bench.predict`: a ladder predicted by ``tokenmill estimate`` (``--estimate``).
- :mod:`tokenmill.bench.report`: derived figures, ``ladder.json`` and ``ladder.md``.
- :mod:`tokenmill.bench.plot`: ``ladder.png``; :mod:`tokenmill.bench.references`: when seed figures are compared.
- :mod:`tokenmill.bench.sizing`: ``max-batch`` and ``max-model`` searches (probes, or the estimate).
- :mod:`tokenmill.bench.cli`: the ``tokenmill bench`` sub-commands.

The shipped ladders live in ``tokenmill/bench/ladders/*.toml``; ``docs/bench.md`` describes them.
"""
