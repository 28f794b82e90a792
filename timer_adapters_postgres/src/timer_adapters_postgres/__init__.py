"""timer-adapters-postgres: coming."""
