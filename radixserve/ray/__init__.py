"""radixserve on Ray Serve (the `ray` extra): engine replicas, an OpenAI ingress, and
`RadixRequestRouter`, which routes by each replica's real prefix cache. See docs/ray.md.

Importing this package needs `ray[serve]` (`pip install 'radixserve[ray]'`); nothing else in
radixserve does.
"""
