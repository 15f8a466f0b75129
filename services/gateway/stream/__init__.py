"""A plan on the bus and its answer: submit, replies, aborts, one choice's output."""
