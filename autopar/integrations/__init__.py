"""autopar inside training frameworks: `autopar.integrations.lightning` (Lightning's `Trainer(strategy="autopar")`).

Importing this package imports no framework: each integration is its own module, imported by the user
(`import autopar.integrations.lightning`), which imports its framework. `_measure` holds what the
integrations share: timing a run's steps and setting them next to the plan's prediction, and feeding the
measurement back to the cost model as a tuner's trial is (autopar.tune.refit).
"""
