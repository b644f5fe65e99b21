"""How payloads cross the data axis: collectives, bit packing, wire accounting."""

from jaxcomp.collectives.wire import collective_bytes, measure_wire_bytes

__all__ = ["collective_bytes", "measure_wire_bytes"]
