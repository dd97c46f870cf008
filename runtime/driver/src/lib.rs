//! The training driver behind `dfc run`: data feeds, batches, epochs, evaluation, metrics, checkpoints.
