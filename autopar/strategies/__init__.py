"""One file per technique, each exposing `apply_X(model, ...)`; `apply.apply_plan` runs them in the one valid order."""
