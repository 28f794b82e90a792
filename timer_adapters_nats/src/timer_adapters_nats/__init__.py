"""timer-adapters-nats: coming."""
