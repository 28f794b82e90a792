"""timer-adapters-memory: coming."""
