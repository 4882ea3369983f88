"""The gateway: the public edge (canteen.v1.Inference): auth, validation, text in and out."""
