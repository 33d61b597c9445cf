"""What every worker component shares: the actor base (engine + loop + gRPC server), the token
stream a Decode call sends, and the load report the router reads. Components import these;
they never import each other."""
