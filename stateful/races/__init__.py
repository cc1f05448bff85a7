"""Thread races: the concurrency an inference scheduler creates, under real threads.

``scenarios`` holds the races (``SCENARIOS``); ``harness`` starts threads together and checks
what they leave behind; ``trace`` keeps each thread's last operations and ``rerun`` turns a
failure into a report with them and a ``kvstate race`` command.
"""
