"""Reward functions: killable child processes (`processes`), the workflows' reward caller (`call`), remote rewards
through reward workers (`remote`, and the `rollq reward-worker` side in `worker`)."""
