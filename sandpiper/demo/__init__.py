"""The end-to-end demo in one place: ``sandpiper demo`` (``make demo``).

- :mod:`sandpiper.demo.tasks`: the demo task suite (sums of numbers that exist only in the
  sandbox) and the weak demonstrator's episodes;
- :mod:`sandpiper.demo.run`: the pipeline (demonstrations through the real collector, SFT
  warm start, GRPO with the collector and the learner, the report).

The CLI command is ``sandpiper/commands/demo.py``; the tiny model it trains is built by
:mod:`sandpiper.models.tiny` (``sandpiper model init-tiny``), which tests use too. Nothing
below the CLI imports this package (the import contracts in ``.importlinter``).
"""
