"""Helpers for the training loops users write: chat datums, rollouts to datums, advantages, datasets."""
