"""Thread races: the concurrency an inference scheduler creates, under real threads.

``scenarios`` holds the races (``SCENARIOS``); ``harness`` starts threads together and checks
what they leave behind.
"""
