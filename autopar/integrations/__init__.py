"""autopar inside training frameworks: `autopar.integrations.hf` (the Hugging Face Trainer: `prepare`,
`AutoparCallback`) and `autopar.integrations.lightning` (Lightning's `Trainer(strategy="autopar")`).

Importing this package imports no framework: each integration is its own module, imported by the user
(`import autopar.integrations.lightning`), which imports its framework. `_measure` holds what the Lightning
strategy uses to time a run's steps, set them next to the plan's prediction, and feed the measurement back to
the cost model as a tuner's trial is (autopar.tune.refit).
"""
