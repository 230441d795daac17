"""What the A/B scripts measure of a tuner task at a config."""


def checked_median_ms(task, config, timer) -> tuple[float, float]:
    """``task`` switched to ``config`` (compiling what is not compiled yet), then (its error
    against the reference by ``task.check()``, the median of three p50s in ms of ``timer(task)``,
    the tuner's timer)."""
    task.configure(config)
    error = task.check()
    return error, sorted(timer(task)[1] for _ in range(3))[1]
