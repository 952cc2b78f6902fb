"""Building blocks of the model families; shapes in comments are per flat batch of tokens."""
