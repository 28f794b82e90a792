"""timer-adapters-sqlite: coming."""
