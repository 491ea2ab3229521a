"""The engine's actors and the messages they exchange."""
