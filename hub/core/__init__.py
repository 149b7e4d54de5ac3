"""The hub's decisions, sans-IO: events in, actions out (`hub.core.core.HubCore`)."""
