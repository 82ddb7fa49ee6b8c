"""Where the roles run: the placement plan and its packing onto nodes, the actor pools (start, replace,
resize), the actor classes of the separate placement and the colocated hosts."""
