"""Checkpoints in the store: the sharded writer and the reader that loads them as data, never as code."""
