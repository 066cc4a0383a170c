"""The web dashboard (web/) and the Grafana dashboard and provisioning (grafana/)."""
