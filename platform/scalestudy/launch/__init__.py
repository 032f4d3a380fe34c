"""What runs the trial body under Ray: the Ray Train adapter, warm worker groups, placement and
resources per worker. The body itself (train/) imports no Ray; this package is the Ray line."""
