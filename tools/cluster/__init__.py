"""More than one server on loopback: replicas behind HAProxy, the chaos soak, the network emulator."""
