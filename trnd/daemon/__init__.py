"""Running trnd as a system service: the sd_notify protocol (notify) and the per-process lifecycle
every role's run() goes through (lifecycle): readiness, watchdog, drain on SIGTERM, reload on SIGHUP."""
