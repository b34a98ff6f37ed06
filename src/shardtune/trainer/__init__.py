"""The worker process: process groups, the training loop and its objectives, evaluation, metrics, the recipe's
engine policy and the sharded model it builds."""
