# idem in a container: one static binary (pure Go, SQLite included) on a
# distroless base, running as a non-root user.
#
#   docker build -t idem .
#   docker run --rm -p 8080:8080 -p 9090:9090 -v idem-data:/data idem proxy --upstream http://api:9000
#
# The image listens on 0.0.0.0:8080 (the API) and 0.0.0.0:9090 (/healthz,
# /readyz, /metrics), and keeps the SQLite store and the journal in /data,
# its working directory (the defaults sqlite:idem.db and idem-journal):
# mount a volume there, or give --store postgres://… (see docs/config.md).
# It sets only the two addresses, as variables, which beat a configuration
# file (a file that says otherwise is told so at start); the store and the
# journal are left to the file, the variables and the flags.

FROM golang:1.26-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o /out/idem ./cmd/idem \
	&& mkdir -p /out/data

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/idem /idem
COPY --from=build --chown=65532:65532 /out/data /data
ENV IDEM_LISTEN=0.0.0.0:8080 \
    IDEM_ADMIN_LISTEN=0.0.0.0:9090
VOLUME /data
WORKDIR /data
USER 65532:65532
EXPOSE 8080 9090
ENTRYPOINT ["/idem"]
CMD ["help"]
