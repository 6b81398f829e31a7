"""The HTTP layer shared by the node and the barrier: serving, the client, errors as data, the cluster secret,
TLS, limits under abuse and membership (peer lists, addresses, DNS)."""
