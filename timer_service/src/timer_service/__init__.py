"""timer-service: coming."""
