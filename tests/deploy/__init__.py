"""The deployment files under deploy/kubernetes/, checked without a cluster."""
